"""The KV budget's arithmetic: a position's bytes from a model's config, the
room `--max-memory` and the device leave, and reservations that fit or not."""

from __future__ import annotations

from runtime.inference.kv_memory import KvMemory, kv_bytes_per_position, kv_capacity

LLAMA_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
"""Grouped-query attention: 8 KV heads of 128."""


def test_a_position_costs_keys_and_values_of_each_kv_head_on_each_layer() -> None:
    # 2 x 32 layers x 8 heads x 128 x 2 bytes: 128 KiB per position.
    assert kv_bytes_per_position(LLAMA_8B, 32, "bfloat16") == 128 * 1024
    assert kv_bytes_per_position(LLAMA_8B, 8, "float32") == 64 * 1024, "a quarter, twice as wide"
    gemma = {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 2304,
        "head_dim": 256,
    }
    assert kv_bytes_per_position(gemma, 1, "float16") == 2 * 4 * 256 * 2, "head_dim as stated"
    plain = {"num_attention_heads": 4, "hidden_size": 256}
    assert kv_bytes_per_position(plain, 2, "float32") == 2 * 2 * 4 * 64 * 4, "no GQA: every head"


def test_the_caches_get_what_max_memory_leaves_beside_the_weights_within_free_memory() -> None:
    assert kv_capacity(10_000, 4_000, None) == 6_000
    assert kv_capacity(10_000, 4_000, 5_000) == 5_000, "the device has less free"
    assert kv_capacity(None, 4_000, 5_000) == 5_000
    assert kv_capacity(3_000, 4_000, None) == 0, "weights alone over the cap: no session fits"
    assert kv_capacity(None, 4_000, None) is None


def test_a_session_reserves_its_whole_budget_and_frees_it_when_it_closes() -> None:
    memory = KvMemory(capacity_bytes=1_000, bytes_per_position=10)
    assert memory.reserve("a", 60)
    assert not memory.reserve("b", 50), "600 + 500 > 1000"
    assert memory.reserve("b", 40) and memory.held_bytes == 1_000
    memory.release("a")
    assert memory.reserve("c", 60)
    assert memory.to_json() == {
        "capacity_bytes": 1_000,
        "held_bytes": 1_000,
        "bytes_per_position": 10,
    }
    assert KvMemory(None, 10).reserve("any", 10**9), "no capacity known: no bound"
