"""A small speed comparison of the GPU path against the CPU path, in process: one verify step
of a random ~170M-parameter Llama (bfloat16, k = 4 drafts, batch 1 and 8) and k = 4 drafts
from a random two-layer draft model, each on the lean runtime (on the GPU its batch-invariant
kernels, kernels/batch_invariant.py) and, on the GPU, through transformers; and batched
rejection sampling (the OpenAI Triton kernels on CUDA vs their torch references). Random
weights: only the times mean anything.

    python scripts/gpu_speed.py [--out results.json] [--profile]

Run by scripts/gpu_check.sh; needs a CUDA device."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.config import SpeculativeConfig  # noqa: E402
from backends.methods.draft_model import DraftModelProposer  # noqa: E402
from backends.runtime.hf_engine import HFEngine  # noqa: E402
from backends.serving import rejection  # noqa: E402
from backends.serving.proposer import DraftRequest, build_proposer  # noqa: E402
from backends.serving.target import TargetRunner, VerifyRequest  # noqa: E402
from kernels import rejection as rk  # noqa: E402

VOCAB, PROMPT, K = 32000, 128, 4


def random_llama(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def timed(fn, device: str, repeat: int) -> float:
    """Median seconds of `fn()` over `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def verify_step(model_dir: Path, device: str, batch: int, repeat: int, runtime: str = "auto") -> float:
    """`runtime` "auto": the lean runtime (on a GPU its batch-invariant Triton kernels); "hf": transformers."""
    runner = TargetRunner(model_dir, dtype="bfloat16", device=device, runtime=runtime)
    gen = torch.Generator().manual_seed(1)
    for seq in range(batch):
        runner.verify(VerifyRequest(seq, torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist(), []))

    def step():
        drafts = torch.randint(0, VOCAB, (batch, K), generator=gen).tolist()
        results = runner.verify_batch([VerifyRequest(seq, [], drafts[seq]) for seq in range(batch)])
        assert not any(isinstance(r, Exception) for r in results), results

    return timed(step, device, repeat)


def draft_step(model_dir: Path, device: str, batch: int, repeat: int, runtime: str = "auto") -> float:
    """`runtime` "auto": the draft model as the server loads it (the lean runtime where it
    runs); "hf": the same model through transformers."""
    from backends.runtime.model_store import load_causal_lm

    if runtime == "auto":
        config = SpeculativeConfig.from_json(
            {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}
        )
        proposer = build_proposer(config, max_model_len=4096, device=device)
    else:
        proposer = DraftModelProposer(HFEngine(load_causal_lm(model_dir, "bfloat16").to(device)), max_model_len=4096)
    gen = torch.Generator().manual_seed(2)
    contexts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(batch)]

    def step():
        drafts = proposer.propose([DraftRequest(seq, contexts[seq], K) for seq in range(batch)])
        for seq, draft in enumerate(drafts):  # the target accepts one draft and corrects the next
            contexts[seq] = contexts[seq] + draft.token_ids[:1] + [7]

    return timed(step, device, repeat)


def rejection_step(device: str, batch: int, repeat: int, kernels: bool) -> float:
    gen = torch.Generator().manual_seed(3)
    counts = [K] * batch
    logits = torch.randn(sum(counts) + batch, VOCAB, generator=gen).to(device)
    drafts = torch.randint(0, VOCAB, (sum(counts),), generator=gen).to(device)
    draft_probs = torch.rand(sum(counts), VOCAB, generator=gen).softmax(-1).to(device)
    temperature = torch.tensor([0.0, 0.8] * (batch // 2))
    functions = (
        (rk.greedy_accept, rk.random_accept, rk.sample_recovered_tokens)
        if kernels
        else (rk.greedy_accept_ref, rk.random_accept_ref, rk.sample_recovered_tokens_ref)
    )
    original = rejection.accept_functions
    rejection.accept_functions = lambda _device: functions
    try:
        return timed(
            lambda: rejection.rejection_sample_batch(drafts, counts, logits, draft_probs, temperature), device, repeat
        )
    finally:
        rejection.accept_functions = original


def profile_step(model_dir: Path, runtime: str) -> None:
    """Where a verify step's time goes on CUDA: torch.profiler's top ops by CPU time, then
    cProfile's top Python functions by their own time."""
    print(f"\n== profile of a verify step on CUDA, runtime {runtime}")
    runner = TargetRunner(model_dir, dtype="bfloat16", device="cuda", runtime=runtime)
    gen = torch.Generator().manual_seed(1)
    runner.verify(VerifyRequest(0, torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist(), []))

    def step():
        runner.verify_batch([VerifyRequest(0, [], torch.randint(0, VOCAB, (K,), generator=gen).tolist())])

    step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    python = cProfile.Profile()
    python.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    python.disable()
    pstats.Stats(python).sort_stats("tottime").print_stats(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true", help="also profile a verify step on CUDA, both engines")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_speed.py needs a CUDA device")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = random_llama(Path(tmp) / "target", hidden=1024, layers=8)
        drafter = random_llama(Path(tmp) / "drafter", hidden=512, layers=2)
        for batch in (1, 8):
            # batch is bound as a default: each lambda runs within its own loop pass anyway
            for name, fn in (
                (f"verify step, {K} drafts, batch {batch}", lambda d, r, rt, b=batch: verify_step(target, d, b, r, rt)),
                (
                    f"draft {K} tokens (draft_model), batch {batch}",
                    lambda d, r, rt, b=batch: draft_step(drafter, d, b, r, rt),
                ),
            ):
                cpu, lean, hf = fn("cpu", 2, "auto"), fn("cuda", 20, "auto"), fn("cuda", 20, "hf")
                rows.append({"what": name, "cpu_ms": cpu * 1e3, "cuda_ms": lean * 1e3})
                rows.append(
                    {"what": f"  same through transformers ({hf / lean:.1f}x)", "cpu_ms": None, "cuda_ms": hf * 1e3}
                )
        if args.profile:
            for runtime in ("hf", "auto"):
                profile_step(target, runtime)
        batch = 32
        rows.append(
            {
                "what": f"rejection sampling, batch {batch} x {K} drafts, V={VOCAB} (cuda: Triton kernels)",
                "cpu_ms": rejection_step("cpu", batch, 2, kernels=False) * 1e3,
                "cuda_ms": rejection_step("cuda", batch, 20, kernels=True) * 1e3,
            }
        )
        rows.append(
            {
                "what": "  same on cuda with the torch references",
                "cpu_ms": None,
                "cuda_ms": rejection_step("cuda", batch, 20, kernels=False) * 1e3,
            }
        )
    print(f"\n{'':62} {'CPU ms':>9} {'CUDA ms':>9} {'speedup':>8}")
    for row in rows:
        cpu = "" if row["cpu_ms"] is None else f"{row['cpu_ms']:9.2f}"
        ratio = "" if row["cpu_ms"] is None else f"{row['cpu_ms'] / row['cuda_ms']:7.1f}x"
        print(f"{row['what']:62} {cpu:>9} {row['cuda_ms']:9.2f} {ratio:>8}")
    print(f"({torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads)")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
