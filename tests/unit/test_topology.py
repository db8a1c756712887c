"""The placement plan (backends/triton_models/topology.py): for each orchestrator of a model
repository, where it verifies and drafts; for each verifier and drafter, whether it serves or
stands by. Pure, from config texts and a GPU count; through real servers:
tests/e2e/test_bls_verifier_server.py, test_model_free_server.py, test_eagle_server.py."""

from __future__ import annotations

import shutil

import pytest

from backends.config import BESIDE_VERIFIER_METHODS, IN_ORCHESTRATOR_METHODS
from backends.serving.proposer import proposer_class, registered_methods
from backends.triton_models.pbtxt import set_parameter
from backends.triton_models.topology import DraftAt, Placement, PlacementError, VerifyAt
from client.cli.launcher import DEFAULT_REPOSITORY

SHIPPED = {
    name: (DEFAULT_REPOSITORY / name / "config.pbtxt").read_text() for name in ("speculative", "verifier", "drafter")
}
GPU_VERIFIER = SHIPPED["verifier"].replace("kind: KIND_CPU", "kind: KIND_GPU")  # one instance per GPU


def plan(method: str = "ngram", num_gpus: int = 0, **configs: str) -> Placement:
    """The shipped repository with `configs` replacing or adding models, its drafter's method
    given (resolving it needs the drafter's model; test_the_drafter_s_method_is_resolved_...)."""
    return Placement({**SHIPPED, **configs}, num_gpus=num_gpus, drafter_methods={"drafter": method})


def orchestrator(**params: str) -> str:
    """The shipped `speculative` config with `params` set."""
    text = SHIPPED["speculative"]
    for key, value in params.items():
        text = set_parameter(text, key, value)
    return text


def test_the_shipped_repository_verifies_and_drafts_in_the_orchestrator(tmp_path, tiny_model_dir):
    """As shipped (verifier_in_process "auto", one CPU verifier instance, ngram, drafter_in_process
    "true"): both peers stand by. The drafter's method is resolved from its own config here."""
    repository = tmp_path / "repo"
    shutil.copytree(DEFAULT_REPOSITORY, repository)
    drafter = repository / "drafter" / "config.pbtxt"
    drafter.write_text(set_parameter(drafter.read_text(), "model", str(tiny_model_dir)))
    shipped = Placement.read(repository, num_gpus=0)
    assert shipped.orchestrators == ("speculative",)
    route = shipped.route("speculative")
    assert (route.verifier, route.verify_at, route.drafter, route.draft_at) == (
        "verifier",
        VerifyAt.IN_PROCESS,
        "drafter",
        DraftAt.IN_PROCESS,
    )
    assert "auto" in route.why
    assert shipped.stands_by_for("verifier") == ("speculative",)
    assert shipped.stands_by_for("drafter") == ("speculative",)
    assert shipped.stands_by_for("speculative") == ()  # nobody names it: it serves


def test_the_drafter_s_method_is_resolved_from_its_config_and_one_that_does_not_resolve_drafts_nowhere(tiny_model_dir):
    def placement(drafter_config: str) -> Placement:
        return Placement({**SHIPPED, "drafter": drafter_config}, num_gpus=0)

    own = set_parameter(SHIPPED["drafter"], "model", str(tiny_model_dir))
    assert (
        placement(set_parameter(own, "speculative_config", '{"method": "suffix"}')).drafting("speculative")
        is DraftAt.IN_PROCESS
    )
    unresolved = placement(set_parameter(own, "speculative_config", '{"method": "nonsense"}'))
    assert unresolved.route("speculative").draft_at is DraftAt.NONE  # plain decoding; its own load fails
    assert unresolved.stands_by_for("drafter") == ()
    missing = Placement({k: v for k, v in SHIPPED.items() if k != "drafter"}, num_gpus=0)
    assert missing.route("speculative").draft_at is DraftAt.NONE


def test_drafter_in_process_false_calls_the_drafter_model():
    placement = plan(speculative=orchestrator(drafter_in_process="false"))
    assert placement.route("speculative").draft_at is DraftAt.BLS
    assert placement.stands_by_for("drafter") == ()
    # Unset: on, the default.
    unset = plan(speculative=SHIPPED["speculative"].replace('key: "drafter_in_process"', 'key: "unset"'))
    assert unset.route("speculative").draft_at is DraftAt.IN_PROCESS
    assert unset.stands_by_for("drafter") == ("speculative",)


@pytest.mark.parametrize("method", sorted(IN_ORCHESTRATOR_METHODS))
def test_methods_that_draft_from_token_ids_alone_draft_in_the_orchestrator(method):
    for verifier_in_process in ("true", "false"):  # wherever it verifies
        placement = plan(method, speculative=orchestrator(verifier_in_process=verifier_in_process))
        assert placement.route("speculative").draft_at is DraftAt.IN_PROCESS
        assert placement.stands_by_for("drafter") == ("speculative",)


HEADS = ("eagle3", "medusa", "mtp", "dflash")
MODEL_DRAFTERS = ("draft_model", "custom_class", "ngram_gpu", "extract_hidden_states")


@pytest.mark.parametrize(
    "method,draft_at", [(m, DraftAt.BESIDE_VERIFIER) for m in HEADS] + [(m, DraftAt.BLS) for m in MODEL_DRAFTERS]
)
def test_heads_draft_beside_the_verifier_other_methods_in_the_drafter_model(method, draft_at):
    """A head drafting beside the verifier leaves its drafter model standing by (no second copy
    of the head, no torch in its stub). A second copy of a draft LM, or user code on the verify
    thread, would not pay: those draft in the drafter model, which serves."""
    placement = plan(method)
    assert placement.route("speculative").draft_at is draft_at
    assert placement.stands_by_for("drafter") == (("speculative",) if draft_at is DraftAt.BESIDE_VERIFIER else ())
    assert placement.stands_by_for("verifier") == ("speculative",)


@pytest.mark.parametrize("method", HEADS)
def test_heads_draft_over_bls_when_the_verifier_or_the_drafter_is_out_of_process(method):
    over_bls = plan(method, speculative=orchestrator(verifier_in_process="false"))
    assert over_bls.route("speculative").draft_at is DraftAt.BLS
    off = plan(method, speculative=orchestrator(drafter_in_process="false"))
    assert off.route("speculative").draft_at is DraftAt.BLS


def test_the_models_each_orchestrator_calls_over_bls():
    """What a graceful stop asks (client/cli/tritonserver.py): whose requests call the verifier
    or the drafter model, which tritonserver's stop would unload under them."""
    assert plan().called_over_bls() == {}  # as shipped: everything in the orchestrator's process
    assert plan("eagle3").called_over_bls() == {}  # the head beside the in-process verifier
    assert plan(speculative=orchestrator(verifier_in_process="false")).called_over_bls() == {
        "speculative": ("verifier",)
    }
    assert plan("draft_model").called_over_bls() == {"speculative": ("drafter",)}
    both = plan("eagle3", speculative=orchestrator(verifier_in_process="false"))
    assert both.called_over_bls() == {"speculative": ("verifier", "drafter")}
    second = orchestrator(drafter_in_process="false", verifier_in_process="true")
    assert plan(other=second).called_over_bls() == {"other": ("drafter",), "speculative": ("verifier",)}
    # One whose placement parameter is none of its values does not load: it calls nothing.
    assert plan("draft_model", speculative=orchestrator(verifier_in_process="yes")).called_over_bls() == {}


def test_the_methods_the_plan_places_are_those_whose_proposers_say_so():
    """The plan knows them without importing a proposer (and torch)."""
    methods = registered_methods()
    assert {m for m in methods if proposer_class(m).in_orchestrator} == set(IN_ORCHESTRATOR_METHODS)
    assert {m for m in methods if proposer_class(m).beside_verifier} == set(BESIDE_VERIFIER_METHODS)


def test_verifier_in_process_auto_true_and_false():
    auto = plan()
    assert auto.route("speculative").verify_at is VerifyAt.IN_PROCESS
    pinned = plan(speculative=orchestrator(verifier_in_process="false"))
    assert pinned.route("speculative").verify_at is VerifyAt.BATCHED
    assert pinned.stands_by_for("verifier") == ()
    # "auto" needs batched steps and a verifier of one instance; "true" verifies here even then.
    unbatched = plan(speculative=orchestrator(batch_verify_steps="false"))
    assert unbatched.route("speculative").verify_at is VerifyAt.PER_STEP
    assert 'batch_verify_steps "false"' in unbatched.route("speculative").why
    two = SHIPPED["verifier"].replace("count: 1", "count: 2")
    assert plan(verifier=two).route("speculative").verify_at is VerifyAt.PER_STEP
    assert "several instances" in plan(verifier=two).route("speculative").why
    forced = plan(verifier=two, speculative=orchestrator(verifier_in_process="TRUE "))
    assert forced.route("speculative").verify_at is VerifyAt.IN_PROCESS
    assert forced.stands_by_for("verifier") == ("speculative",)
    assert 'verifier_in_process "true"' in forced.route("speculative").why


def test_verifier_in_process_auto_counts_the_gpus_of_a_gpu_verifier():
    """A KIND_GPU group without `gpus` makes one instance per GPU: "auto" verifies in process
    on one GPU, not on two (steps then go one request a step: a batch cannot address the
    instances); a group naming its GPU is one instance whatever the count."""
    assert plan(num_gpus=1, verifier=GPU_VERIFIER).route("speculative").verify_at is VerifyAt.IN_PROCESS
    two_gpus = plan(num_gpus=2, verifier=GPU_VERIFIER)
    assert two_gpus.route("speculative").verify_at is VerifyAt.PER_STEP
    assert two_gpus.stands_by_for("verifier") == ()
    pinned = GPU_VERIFIER.replace("KIND_GPU", "KIND_GPU gpus: [ 1 ]")
    assert plan(num_gpus=2, verifier=pinned).route("speculative").verify_at is VerifyAt.IN_PROCESS
    forced = plan(num_gpus=2, verifier=GPU_VERIFIER, speculative=orchestrator(verifier_in_process="true"))
    assert forced.route("speculative").verify_at is VerifyAt.IN_PROCESS
    off = plan(num_gpus=1, verifier=GPU_VERIFIER, speculative=orchestrator(verifier_in_process="false"))
    assert off.route("speculative").verify_at is VerifyAt.BATCHED


def test_gpus_are_counted_once_and_only_where_a_decision_needs_them():
    """Counting imports torch, which a model standing by does not load."""
    asked = []

    def count() -> int:
        asked.append(1)
        return 1

    cpu = Placement(SHIPPED, num_gpus=count, drafter_methods={"drafter": "ngram"})
    assert cpu.stands_by_for("verifier") == ("speculative",) and cpu.stands_by_for("drafter") == ("speculative",)
    assert cpu.route("speculative").verify_at is VerifyAt.IN_PROCESS and not asked
    gpu = Placement({**SHIPPED, "verifier": GPU_VERIFIER}, num_gpus=count, drafter_methods={"drafter": "ngram"})
    assert gpu.stands_by_for("drafter") == ("speculative",) and not asked  # ngram: where it verifies is moot
    assert gpu.stands_by_for("verifier") == ("speculative",) and asked == [1]
    gpu.route("speculative")
    assert asked == [1]
    # A second GPU verifier, called over BLS: whether its steps batch asks the same count.
    second = orchestrator(verifier_model_name="verifier_b", verifier_in_process="false")
    gpu = Placement(
        {**SHIPPED, "verifier": GPU_VERIFIER, "verifier_b": GPU_VERIFIER, "speculative_b": second}, num_gpus=count
    )
    assert gpu.route("speculative").verify_at is VerifyAt.IN_PROCESS
    assert gpu.route("speculative_b").verify_at is VerifyAt.BATCHED
    assert asked == [1, 1]


def test_a_second_orchestrator_naming_the_same_verifier():
    """Two "auto" orchestrators naming one verifier share it over BLS rather than each load a
    copy; one that verifies in process and one over BLS: the verifier serves the second."""
    second = plan(speculative_b=SHIPPED["speculative"])
    assert second.orchestrators == ("speculative", "speculative_b")
    for name in second.orchestrators:
        assert second.route(name).verify_at is VerifyAt.BATCHED
    assert second.stands_by_for("verifier") == ()
    mixed = plan(
        speculative=orchestrator(verifier_in_process="true"), speculative_b=orchestrator(verifier_in_process="false")
    )
    assert mixed.route("speculative").verify_at is VerifyAt.IN_PROCESS
    assert mixed.stands_by_for("verifier") == ()
    both = plan(speculative_b=orchestrator(verifier_in_process="true"))
    assert both.stands_by_for("verifier") == ()  # the first one ("auto") calls it: another names it
    other = plan(speculative_b=orchestrator(verifier_model_name="other_verifier"))
    assert other.route("speculative").verify_at is VerifyAt.IN_PROCESS  # a verifier of its own
    assert other.stands_by_for("verifier") == ("speculative",)


def test_a_second_orchestrator_naming_the_same_drafter():
    both = plan(speculative_b=SHIPPED["speculative"])
    assert both.stands_by_for("drafter") == ("speculative", "speculative_b")
    one_calls_it = plan(speculative_b=orchestrator(drafter_in_process="false"))
    assert one_calls_it.route("speculative").draft_at is DraftAt.IN_PROCESS  # still drafts here
    assert one_calls_it.route("speculative_b").draft_at is DraftAt.BLS
    assert one_calls_it.stands_by_for("drafter") == ()  # it serves the second
    assert plan().stands_by_for("other_drafter") == ()  # nobody names it


def test_invalid_values_refuse_the_orchestrator_s_load_by_name_and_read_as_off_for_its_peers():
    cases = {
        "verifier_in_process": ("yes", "parameter verifier_in_process must be one of auto, true, false, got 'yes'"),
        "drafter_in_process": ("no", 'parameter drafter_in_process must be "true" or "false", got \'no\''),
        "batch_verify_steps": ("1", 'parameter batch_verify_steps must be "true" or "false", got \'1\''),
    }
    for name, (value, message) in cases.items():
        placement = plan(speculative=orchestrator(**{name: value}))
        with pytest.raises(PlacementError, match=message):
            placement.route("speculative")
        assert isinstance(PlacementError(), ValueError)
    assert plan(speculative=orchestrator(verifier_in_process="yes")).stands_by_for("verifier") == ()
    assert plan(speculative=orchestrator(drafter_in_process="no")).stands_by_for("drafter") == ()


def test_a_verifier_without_a_readable_config():
    """ "auto" then verifies over BLS, one request a step (that verifier's load fails on its
    own); "true" places it here, and the orchestrator's load says it cannot read it."""
    missing = Placement({"speculative": SHIPPED["speculative"]}, num_gpus=0)
    route = missing.route("speculative")
    assert route.verify_at is VerifyAt.PER_STEP and "no readable config of 'verifier'" in route.why
    forced = Placement({"speculative": orchestrator(verifier_in_process="true")}, num_gpus=0)
    assert forced.route("speculative").verify_at is VerifyAt.IN_PROCESS


def test_the_plan_reads_every_config_of_the_repository(tmp_path):
    repository = tmp_path / "repo"
    shutil.copytree(DEFAULT_REPOSITORY, repository)
    (repository / "notes").mkdir()  # no config.pbtxt: not a model
    (repository / "speculative_b").mkdir()
    (repository / "speculative_b" / "config.pbtxt").write_text(orchestrator(verifier_in_process="false"))
    placement = Placement.read(repository, num_gpus=0, drafter_methods={"drafter": "ngram"})
    assert sorted(placement.configs) == ["drafter", "speculative", "speculative_b", "verifier"]
    assert placement.stands_by_for("verifier") == ()
