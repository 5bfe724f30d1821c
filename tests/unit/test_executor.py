"""--executor: passed to vLLM as distributed_executor_backend; Ray refused up front where it cannot run."""


def test_the_ray_executor_is_refused_before_vllm_starts_where_it_cannot_run(monkeypatch):
    import builtins

    import pytest

    from hscapture import CompatibilityError, ConfigError
    from hscapture.cli.extract import check_executor

    check_executor(None)
    check_executor("mp")
    real_import = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match="needs the `ray` package"):
        check_executor("ray")
    monkeypatch.setattr(builtins, "__import__", real_import)
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.device_name != "cpu":
        pytest.skip("the CPU platform is the one without a Ray executor")
    import sys
    import types

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    with pytest.raises(CompatibilityError, match="cpu platform does not run the Ray executor.*--executor mp"):
        check_executor("ray")
