"""A bridged vLLM's LoRA adapters as its load report lists them (bridge/adapters.py): read from
``vllm:lora_requests_info`` and ``/v1/models`` (inferred), or from the residency gauges vLLM PR #54830
proposes when a server has them."""

from __future__ import annotations

from kvmesh.bridge.adapters import AdapterTracker, LoraInfo, listed_adapters, parse_lora_info
from kvmesh.contract.types import AdapterLevel, AdapterResidency

GPU, CPU = AdapterLevel.GPU, AdapterLevel.CPU


def info_page(*logs: tuple[str, str], max_lora: int = 2, extra: str = "") -> str:
    # NOTE: vLLM's own shape: one label set per stats log, set to its time; the older ones stay
    return "# TYPE vllm:lora_requests_info gauge\n" + "".join(
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{r}",waiting_lora_adapters="{w}"}} '
        f"{1.7e9 + i}\n" for i, (r, w) in enumerate(logs)) + extra


def test_the_newest_label_set_is_the_engines_state():
    # the newest log is the first one in the page's order here: the value (its time) decides, not the order
    page = ("# TYPE vllm:lora_requests_info gauge\n"
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b,c",waiting_lora_adapters="d"} 1.7e9\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.6e9\n')
    assert parse_lora_info(page) == LoraInfo(4, ("b", "c"), ("d",), None)
    assert parse_lora_info("vllm:num_requests_running 1\n") is None  # LoRA off: no series
    # on, before vLLM's first request: the series is registered without a sample (slots not said yet)
    assert parse_lora_info("# TYPE vllm:lora_requests_info gauge\n") == LoraInfo(0, (), (), None)


def test_listed_adapters_are_the_entries_with_a_parent():
    models = {"data": [{"id": "/models/base", "parent": None}, {"id": "sql", "parent": "/models/base"},
                       {"id": "chat", "parent": "/models/base"}, "junk"]}
    assert listed_adapters(models) == ["sql", "chat"]


def test_running_adapters_hold_slots_the_rest_by_recency_and_idle_ones_are_in_cpu_memory():
    t = AdapterTracker()
    listed = ["a", "b", "c", "d"]  # loaded at start-up: in CPU memory until a request of them runs
    assert t.update(parse_lora_info(info_page(("", ""))), listed) == (
        tuple(AdapterResidency(n, CPU, 0) for n in "abcd"), 2)
    assert t.source == "inferred"
    got, _ = t.update(parse_lora_info(info_page(("a", "b"))), listed)
    assert got == (AdapterResidency("a", GPU, 1), AdapterResidency("b", GPU, 1), AdapterResidency("c", CPU, 0),
                   AdapterResidency("d", CPU, 0))
    t.update(parse_lora_info(info_page(("c", ""))), listed)
    got, _ = t.update(parse_lora_info(info_page(("d", ""))), listed)
    # 2 slots: d runs; of the others the most recently active (c) keeps the second; a and b went to CPU memory
    assert {r.name: r.level for r in got} == {"a": CPU, "b": CPU, "c": GPU, "d": GPU}
    assert {r.name: r.requests for r in got} == {"a": 0, "b": 0, "c": 0, "d": 1}
    # an adapter unloaded (gone from /v1/models, no request) leaves the report
    got, _ = t.update(parse_lora_info(info_page(("", ""))), ["a", "c", "d"])
    assert [r.name for r in got] == ["a", "c", "d"]


def test_more_running_adapters_than_slots_are_all_in_slots_and_the_gauges_win_when_present():
    t = AdapterTracker()
    got, slots = t.update(parse_lora_info(info_page(("x,y,z", ""), max_lora=2)), [])
    assert slots == 2 and all(r.level == GPU for r in got) and [r.name for r in got] == ["x", "y", "z"]
    gauges = ("# TYPE vllm:lora_adapter_loaded gauge\n"
              'vllm:lora_adapter_loaded{adapter_name="x",level="gpu"} 1.0\n'
              'vllm:lora_adapter_loaded{adapter_name="q",level="cpu"} 1.0\n'
              'vllm:lora_adapter_loaded{adapter_name="gone",level="gpu"} 0.0\n')
    got, _ = t.update(parse_lora_info(info_page(("x", ""), extra=gauges)), ["never", "read"])
    assert t.source == "gauges"
    assert got == (AdapterResidency("q", CPU, 0), AdapterResidency("x", GPU, 1))


def test_no_lora_no_adapters():
    t = AdapterTracker()
    assert t.update(None, ["a"]) == ((), 0) and t.source == ""
