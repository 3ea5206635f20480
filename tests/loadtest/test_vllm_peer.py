"""``VllmServer``'s command and environment, without starting vLLM."""

from __future__ import annotations

from loadtest.vllm_peer import VllmServer


def test_the_default_kv_cache_is_vllms_cpu_variable_and_a_size_in_bytes_unsets_it() -> None:
    default = VllmServer("python", "/m", 8001)
    assert "--kv-cache-memory-bytes" not in default.command()
    assert default.environment({"PATH": "/bin"})["VLLM_CPU_KVCACHE_SPACE"] == "1"

    sized = VllmServer("python", "/m", 8001, kv_cache_bytes=64 * 2**20)
    command = sized.command()
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    # the variable would override the flag in vLLM's CPU platform: unset, even if inherited
    env = sized.environment({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"


def test_extra_env_has_the_last_word() -> None:
    server = VllmServer("python", "/m", 8001, extra_env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert server.environment({})["VLLM_CPU_KVCACHE_SPACE"] == "2"
