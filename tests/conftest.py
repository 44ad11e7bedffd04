import atexit
import os
import shutil
import tempfile
import time
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Mesh.local reads the calibration `meshplan calibrate` caches; a developer's own would change
# the plans tests expect, so the suite (and every process it starts) sees an empty cache
os.environ["MESHPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshplan-test-cache-")
atexit.register(shutil.rmtree, os.environ["MESHPLAN_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _drop_truncated_inductor_libraries() -> None:
    """A compile killed while it linked leaves an empty ``.so`` in inductor's cache, and every
    later compile of that kernel fails on it ("file too short"; seen after an interrupted
    run, 2026-11-29): the suite removes such files before it compiles anything."""
    import getpass

    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:  # an empty file older than a minute: not a link in progress
                if name.endswith(".so") and os.path.getsize(path) == 0 \
                        and time.time() - os.path.getmtime(path) > 60:
                    os.remove(path)
            except OSError:  # the other pytest worker removed it first
                pass


_drop_truncated_inductor_libraries()
warnings.filterwarnings("ignore", module="transformers")


# The longest modules first: with `pytest -n 2 --dist loadfile` (the README's command) each
# module runs whole on one worker, and a long module left for last runs alone on one core.
# Order of the seconds each module took in the full run of 2026-11-29 on main at dd805aa
# (benchmarks/results/suite_time.md): the step-peak measurement's module ~570, the own-loop
# matrix ~560, the zoo run ~310, the multi-node launch ~260, the examples ~250, ...; the rest
# keep their order.
LONGEST_FIRST = ["test_costmodel_engine", "test_own_loop_matrix", "test_zoo_run",
                 "test_launch_multinode", "test_examples", "test_pipeline_runtime",
                 "test_runtime", "test_generative", "test_support", "test_cp_modules",
                 "test_module_engine_pp", "test_context_parallel", "test_stacks_torchtitan",
                 "test_user_loss", "test_runtime_strategies", "test_tp_correctness",
                 "test_public_run", "test_pipeline_eval", "test_cli_factories",
                 "test_checkpoint", "test_moe_ep", "test_cli", "test_property_plans",
                 "test_zoo_trace", "test_one_pricer", "test_module_engine",
                 "test_compiled_memory", "test_trace", "test_dropout_run", "test_t5_cli_run"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2],
                                         len(LONGEST_FIRST)))


@pytest.fixture(scope="session")
def tiny_llama_h100():
    """A small Llama (hidden 256, 2 layers, 32K vocabulary) built and traced on the meta device
    at 8 x 256 tokens, and one DGX H100 node: the pure cost-model tests' shared case."""
    import meshplan
    from meshplan.specs import example_inputs, parse_model_spec
    from meshplan.tracing import trace

    model = parse_model_spec("transformers:llama?hidden_size=256&intermediate_size=512"
                             "&num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=2"
                             "&vocab_size=32000&max_position_embeddings=256").build("meta")
    return model, trace(model, example_inputs(model, 8, 256)), \
        meshplan.Mesh.preset("dgx-h100", nodes=1)
