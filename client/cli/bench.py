"""`tritonspec bench`: speculative decoding methods vs plain decoding through a real server,
batch 1, greedy, on a fixed, versioned prompt set (code, chat, RAG with repeated text,
multi-turn), optionally beside Hugging Face's own assisted generation on the same prompts.

Each method gets its own server (the drafter entry configured for it); plain decoding is
measured on that same server with num_draft_tokens=0, interleaved with the method's runs,
since this kind of machine is noisy. Per method and category: tokens/s, speedup vs plain,
mean acceptance length, per-position acceptance, and time per step split into drafting,
the verifier's forward pass and everything else (BLS hops, accept/reject, detokenization,
streaming): the orchestration overhead.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from client.api.triton import Generation, grpc_generate

# The versioned prompt sets: short prompts of four families, long contexts (a 2k and an
# 8k-token document with a question, a source file to edit, a 30-turn chat; built by
# scripts/make_long_prompts.py), and schema-constrained extraction and tool calls (`json`,
# each prompt with its JSON schema, which --structured makes the output follow).
PROMPT_SETS = {
    "short": Path(__file__).parents[1] / "data" / "bench_prompts.json",
    "long": Path(__file__).parents[1] / "data" / "long_prompts.json",
    "json": Path(__file__).parents[1] / "data" / "json_prompts.json",
}

# Method name -> speculative config (draft_model's `model` is filled from --draft-model).
METHOD_CONFIGS: dict[str, dict] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "ngram_gpu": {"method": "ngram_gpu", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    # Trained heads (`tritonspec train`); `model` is the head trained for the target.
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "num_speculative_tokens": 3},
    "mlp_speculator": {"method": "mlp_speculator", "num_speculative_tokens": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    # Block drafters (trained 7 drafts deep): one drafter pass fills the whole block.
    "dflash": {"method": "dflash", "num_speculative_tokens": 7},
    "dspark": {"method": "dspark", "num_speculative_tokens": 7},
    # Draft trees (one verification pass over the nodes that pay); compare each with its chain
    # above. 16 levels, 16 nodes: a confident match grows one deep branch, an unsure one several
    # short ones, and each step verifies only its best-scored nodes (adaptive.DraftCut). A tree's
    # alternatives cost nodes, not depth, so it takes short matches twice as deep and
    # continuations down to 5% (the chain: 1x and 10%).
    "suffix+tree": {
        "method": "suffix",
        "num_speculative_tokens": 16,
        "suffix_decoding_max_tree_nodes": 16,
        "suffix_decoding_use_tree_spec": True,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.05,
    },
    "draft_model+tree": {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        # The chain plus the draft's next two candidates at each of its first two positions.
        "speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]",
    },
    "medusa+tree": {
        "method": "medusa",
        "num_speculative_tokens": 3,
        # Medusa's sparse-tree shape: more candidates where the first heads are surer.
        "speculative_token_tree": "[(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),"
        " (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]",
    },
    **{
        f"{method}+tree": {
            "method": method,
            "num_speculative_tokens": 4,
            "dynamic_tree": {"top_k": 4, "total_token": 16},
        }
        for method in ("eagle", "eagle3", "mtp")
    },
}


def method_config(name: str, profile: dict | None = None) -> dict:
    """The speculative config a bench run of `name` serves: a profile's own settings where it
    drafts with that method (its draft model, quantization, k), a tree variant's tree on top."""
    config = dict(METHOD_CONFIGS[name])
    if profile is None or profile.get("method") != base_method(name):
        return config
    return dict(profile) if name == base_method(name) else {**profile, **config}


def base_method(name: str) -> str:
    """The method a bench entry runs ("eagle3+tree" -> "eagle3")."""
    return name.split("+")[0]


def read_prompt_file(path: Path) -> dict[str, list[str]]:
    """Prompts of your own, {category: [prompts]}: a JSON list (category "custom"), a JSON
    {category: [prompts]} (a trained head's validation_prompts.json is a list), a prompt set's
    own layout ({"version": ..., "prompts": {category: [prompts]}}: a copy of one, edited), or,
    in a file not named *.json, one prompt per line."""
    try:
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" else [line for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {e}") from e
    if isinstance(loaded, dict) and isinstance(loaded.get("prompts"), (dict, list)):
        loaded = loaded["prompts"]
    prompts = {"custom": loaded} if isinstance(loaded, list) else loaded
    if (
        not isinstance(prompts, dict)
        or not prompts
        or not all(isinstance(ps, list) and ps and all(isinstance(p, str) and p for p in ps) for ps in prompts.values())
    ):
        raise ValueError(
            f"{path}: expected a JSON list of non-empty prompts, {{category: [prompts]}}, or one prompt per line"
        )
    return prompts


def load_prompts(
    categories: list[str] | None = None, path: Path | None = None, prompt_set: str = "short"
) -> tuple[str, dict[str, list[str]]]:
    """A versioned benchmark prompt set (PROMPT_SETS), or a file of your own (`read_prompt_file`)."""
    if path is None:
        data = json.loads(PROMPT_SETS[prompt_set].read_text())
        version, prompts = data["version"], data["prompts"]
    else:
        version, prompts = f"file {path.name}", read_prompt_file(path)
    if categories:
        unknown = set(categories) - set(prompts)
        if unknown:
            raise ValueError(f"unknown prompt categories {sorted(unknown)}; known: {sorted(prompts)}")
        prompts = {c: prompts[c] for c in categories}
    return version, prompts


def load_constraints(prompts: dict[str, list[str]], prompt_set: str) -> dict[str, list[dict]]:
    """For `--structured`: each prompt's output constraint (vLLM's `structured_outputs`), from
    the prompt set's schemas ({category: [schema per prompt]})."""
    schemas = json.loads(PROMPT_SETS[prompt_set].read_text()).get("schemas", {})
    missing = sorted(set(prompts) - set(schemas))
    if missing:
        raise ValueError(
            f"--structured needs a schema for every prompt; categories {missing} have none (use --prompt-set json)"
        )
    return {c: [{"json": schema} for schema in schemas[c]] for c in prompts}


def measure(
    grpc_url: str,
    prompts: dict[str, list[str]],
    max_tokens: int,
    repeats: int,
    label: str,
    draft_tokens: int | None = None,
    ignore_eos: bool = True,
    constraints: dict[str, list[dict]] | None = None,
) -> dict[str, dict[str, list[Generation]]]:
    """{category: {"plain": [...], "speculative": [...]}}, runs interleaved. `draft_tokens`:
    the speculative requests ask for exactly that many drafts per step (no adaptive length).
    `ignore_eos` (the default) makes every run `max_tokens` long; without it a run ends where
    the model ends its answer, so drafts are judged on the text the model means to write.
    `constraints`: each prompt's structured_outputs, sent with every run; then "plain" is
    constrained plain decoding without forced drafts (as the peers decode), and a third mode,
    "forced", is plain decoding with the grammar's forced tokens as its only drafts."""
    grpc_generate(grpc_url, "warm up", max_tokens=8)
    modes = ("plain", "speculative", "forced") if constraints else ("plain", "speculative")
    runs: dict[str, dict[str, list[Generation]]] = {c: {mode: [] for mode in modes} for c in prompts}
    jobs = [(c, i, mode) for _ in range(repeats) for c, ps in prompts.items() for i in range(len(ps)) for mode in modes]
    for category, i, mode in tqdm(jobs, desc=f"bench {label}", unit="request"):
        extra: dict[str, Any] = (
            {"num_draft_tokens": 0}
            if mode != "speculative"
            else ({"num_draft_tokens": draft_tokens} if draft_tokens else {})
        )
        if constraints:
            extra["sampling_parameters"] = {
                "structured_outputs": constraints[category][i],
                "forced_drafts": mode != "plain",
            }
        runs[category][mode].append(
            grpc_generate(grpc_url, prompts[category][i], max_tokens=max_tokens, ignore_eos=ignore_eos, **extra)
        )
    return runs


def summarize(results: list[Generation]) -> dict[str, Any]:
    """Totals over all runs (so long and short prompts weigh by their tokens)."""
    metrics = [r.perf_metrics for r in results]
    tokens = sum(r.num_output_tokens for r in results)
    seconds = sum(r.seconds for r in results)
    steps = sum(m["num_steps"] for m in metrics)
    drafts = sum(m["num_drafts"] for m in metrics)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    drafted = sum(m["num_draft_tokens"] for m in metrics)
    width = max((len(m["accepted_per_position"]) for m in metrics), default=0)
    per_position = [
        sum(m["accepted_per_position"][i] for m in metrics if i < len(m["accepted_per_position"])) for i in range(width)
    ]
    # Time to first token (the prefill), and the decoding speed after it.
    first = [r.first_token_s for r in results if r.first_token_s is not None]
    decode_s = sum(r.seconds - r.first_token_s for r in results if r.first_token_s is not None)
    return {
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_ms": statistics.median(first) * 1e3 if first else 0.0,
        "decode_tokens_per_s": (tokens - len(first)) / decode_s if decode_s > 0 else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position_acceptance": [n / drafts for n in per_position] if drafts else [],
        "tokens_per_step": tokens / steps if steps else 0.0,
        "nodes_per_step": drafted / drafts if drafts else 0.0,  # drafts per drafting step (tree nodes)
        "draft_ms_per_step": sum(m["draft_ms"] for m in metrics) / steps,
        "verify_ms_per_step": sum(m["verify_ms"] for m in metrics) / steps,
        "overhead_ms_per_step": sum(m["overhead_ms"] for m in metrics) / steps,
        "overhead_share": sum(m["overhead_ms"] for m in metrics) / sum(m["total_ms"] for m in metrics),
        "output_token_ids": [r.output_ids for r in results],
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ; None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(runs: dict[str, dict[str, list[Generation]]]) -> dict[str, dict]:
    """Per category: plain and speculative summaries, speedup, and where speculative output
    first departs from plain output. In float32 it never does (the tests assert it); in
    bfloat16 a (k+1)-token verify pass can round differently from a 1-token step and flip an
    argmax at a near-tie, so the bench reports it instead of hiding it."""
    out = {}
    for category, by_mode in runs.items():
        plain, spec = summarize(by_mode["plain"]), summarize(by_mode["speculative"])
        divergence = [
            first_divergence(a, b) for a, b in zip(plain.pop("output_token_ids"), spec.pop("output_token_ids"))
        ]
        out[category] = {
            "plain": plain,
            "speculative": spec,
            "identical_outputs": sum(d is None for d in divergence),
            "outputs": len(divergence),
            "first_divergence": divergence,
            "speedup_vs_plain": spec["tokens_per_s"] / plain["tokens_per_s"],
        }
        if "forced" in by_mode:  # structured: forced tokens as the only drafts
            forced = summarize(by_mode["forced"])
            forced.pop("output_token_ids")
            out[category]["forced"] = forced
            out[category]["forced_speedup_vs_plain"] = forced["tokens_per_s"] / plain["tokens_per_s"]
    return out


def hf_comparison(
    target: str, draft: str | None, prompts: dict[str, list[str]], max_tokens: int, dtype: str
) -> dict[str, dict[str, float]]:
    """Hugging Face plain greedy, assisted generation (with a draft model) and prompt lookup
    on the same prompts: tokens/s per category."""
    from client.cli.hf_baseline import hf_assisted, hf_greedy_timed, hf_prompt_lookup

    flat = [(c, p) for c, ps in prompts.items() for p in ps]
    texts = [p for _, p in flat]
    runners = {
        "hf_greedy": lambda: hf_greedy_timed(target, texts, max_tokens, dtype),
        "hf_prompt_lookup": lambda: hf_prompt_lookup(target, texts, max_tokens, dtype=dtype),
    }
    if draft:
        runners["hf_assisted"] = lambda: hf_assisted(target, draft, texts, max_tokens, dtype)
    out: dict[str, dict[str, float]] = {}
    for name, runner in tqdm(runners.items(), desc="hugging face", unit="mode"):
        rows = runner()
        for category in prompts:
            picked = [r for (c, _), r in zip(flat, rows) if c == category]
            out.setdefault(category, {})[name] = sum(r["num_tokens"] for r in picked) / sum(
                r["seconds"] for r in picked
            )
    return out


def engine_from_log(server_log: Path) -> str:
    """What the verifier said it runs on (engine, batch invariance), from a server log."""
    for line in server_log.read_text(errors="replace").splitlines():
        if "target runs " in line:
            said = line.split("target runs ", 1)[1].split(":")[0].strip()  # "on the lean runtime, ..."
            return said.removeprefix("on the ").removeprefix("through ")
    return "unknown (no 'target runs' line in the server log)"


def verified_in_process_from_log(server_log: Path) -> bool:
    """Whether the orchestrator said it verifies in its own process (verifier_in_process)."""
    return "verifying in this process" in server_log.read_text(errors="replace")


def format_report(report: dict) -> str:
    lines = [
        f"prompt set v{report['prompt_set']}, {report['max_tokens']} tokens, {report['repeats']} repeat(s), "
        f"target {report['model']} ({report['dtype']}), engine: {report.get('engine', 'unknown')}"
        f"{', verified in process' if report.get('verifier_in_process') else ''}; "
        "`ttft`: median time to first token (ms) and `dec/s`: tokens/s after it, both of the speculative runs; "
        "`same`: outputs identical to plain decoding",
        f"{'method':12} {'category':11} {'tok/s':>7} {'plain':>7} {'speedup':>8} {'ttft':>6} {'dec/s':>6} "
        f"{'MAL':>5} {'nodes':>5} {'accept':>7} "
        f"{'draft':>6} {'verify':>7} {'ovh':>5} {'ovh%':>5} {'same':>5} {'diverge@':>9}  per-position acceptance",
    ]
    for method, by_category in report["methods"].items():
        for category, r in by_category.items():
            s = r["speculative"]
            lines.append(
                f"{method:12} {category:11} {s['tokens_per_s']:7.1f} {r['plain']['tokens_per_s']:7.1f} "
                f"{r['speedup_vs_plain']:7.2f}x {s['ttft_ms']:6.0f} {s['decode_tokens_per_s']:6.1f} "
                f"{s['mean_acceptance_length']:5.2f} {s['nodes_per_step']:5.1f} "
                f"{s['acceptance_rate']:7.2f} "
                f"{s['draft_ms_per_step']:6.1f} {s['verify_ms_per_step']:7.1f} {s['overhead_ms_per_step']:5.1f} "
                f"{s['overhead_share']:5.1%} {r['identical_outputs']:>2}/{r['outputs']:<2} "
                f"{','.join('-' if d is None else str(d) for d in r['first_divergence']):>9} "
                + " ".join(f"{a:.2f}" for a in s["per_position_acceptance"])
            )
            if "forced" in r:
                lines.append(
                    f"{'  forced':12} {category:11} {r['forced']['tokens_per_s']:7.1f} {r['plain']['tokens_per_s']:7.1f} "
                    f"{r['forced_speedup_vs_plain']:7.2f}x  (plain with the grammar's forced tokens as its only drafts; "
                    f"{r['forced']['tokens_per_step']:.2f} tokens/step)"
                )
    for category, hf in report.get("huggingface", {}).items():
        lines.append(f"{'huggingface':12} {category:11} " + "  ".join(f"{k}={v:.1f} tok/s" for k, v in hf.items()))
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(next(iter(report["methods"].values())))
    series = {
        "plain": [
            statistics.median(report["methods"][m][c]["plain"]["tokens_per_s"] for m in report["methods"])
            for c in categories
        ]
    }
    for method, by_category in report["methods"].items():
        series[method] = [by_category[c]["speculative"]["tokens_per_s"] for c in categories]
    for name in ("hf_greedy", "hf_assisted", "hf_prompt_lookup"):
        if report.get("huggingface") and name in next(iter(report["huggingface"].values())):
            series[name] = [report["huggingface"][c][name] for c in categories]
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(categories)), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories)
    ax.set_ylabel("output tokens/s (batch 1, greedy)")
    ax.set_title(f"{report['model']} ({report['dtype']}), prompt set v{report['prompt_set']}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verify_batch_cost(
    model: Path,
    dtype: str,
    batch: int,
    drafts: int,
    context: int = 200,
    repeats: int = 10,
    runtime: str = "auto",
    batch_invariant: str = "auto",
) -> dict[str, float | str]:
    """Wall time of one verify step for `batch` sequences in one forward vs for one sequence,
    and of one sequence's plain 1-token step (in process, no server): what batched
    verification and drafts cost on the target's engine (`runtime`, as TargetRunner's)."""
    from backends.serving.target import TargetRunner, VerifyRequest

    if batch < 1 or drafts < 0 or context < 1:
        raise ValueError(f"need --batch >= 1, --drafts >= 0 and --context >= 1, got {batch}, {drafts}, {context}")
    # No prefix caching: a repeat rolls back into the prompt's blocks, which caching would keep.
    runner = TargetRunner(model, dtype, runtime=runtime, batch_invariant=batch_invariant, prefix_caching=False)
    if context + drafts + 1 > runner.max_model_len:
        raise ValueError(
            f"--context {context} + --drafts {drafts} + 1 tokens do not fit the model's window of {runner.max_model_len}"
        )
    for seq_id in range(batch):
        runner.verify(VerifyRequest(seq_id, list(range(100 + 7 * seq_id, 100 + 7 * seq_id + context)), []))

    def step(seq_ids: range, num_drafts: int = drafts) -> float:
        start = time.perf_counter()
        runner.verify_batch([VerifyRequest(i, [], list(range(5, 5 + num_drafts))) for i in seq_ids])
        for i in seq_ids:  # back to `context` tokens: every repeat measures the same shape
            runner.sequences[i].token_ids[context:] = []
            runner.sequences[i].num_cached = context - 1
            runner.engine.truncate(i, context - 1)
        return time.perf_counter() - start

    for _ in range(3):  # warm-up of every shape
        step(range(1)), step(range(batch)), step(range(1), 0)
    one = statistics.median(step(range(1)) for _ in range(repeats))
    many = statistics.median(step(range(batch)) for _ in range(repeats))
    plain = statistics.median(step(range(1), 0) for _ in range(repeats))
    return {
        "engine": runner.engine.name + f", batch-invariant {'on' if runner.batch_invariant else 'off'}",
        "one_ms": one * 1e3,
        "batch_ms": many * 1e3,
        "ratio": many / one,
        "plain_ms": plain * 1e3,
        "drafts_ratio": one / plain,
    }
