"""CLI flags derived from the config dataclasses: every field is a flag, defaults are the config's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvmesh.cli import build_parser
from kvmesh.commands.config_args import add_config_args, attribute_docs, config_from_args
from kvmesh.contract.settings import NO_FLAG, flag
from kvmesh.kv_service.config import KVServiceConfig
from kvmesh.model_worker.config import EngineConfig, WorkerConfig
from kvmesh.router.config import RouterConfig

CONFIGS = [("router", RouterConfig, {}), ("worker", WorkerConfig, {}), ("worker", EngineConfig, {"model": "m"}),
           ("kv-service", KVServiceConfig, {}), ("offline", EngineConfig, {"model": "m"})]


@pytest.mark.parametrize(("command", "cls", "given"), CONFIGS, ids=lambda v: getattr(v, "__name__", v))
def test_no_flags_build_the_config_defaults(command, cls, given):
    argv = [command] + (["--input", "i", "--output", "o"] if command == "offline" else [])
    args = build_parser(only=command).parse_args(argv)
    assert config_from_args(cls, args, **given) == cls(**given)


@pytest.mark.parametrize(("command", "cls", "given"), CONFIGS, ids=lambda v: getattr(v, "__name__", v))
def test_every_field_has_a_documented_flag(command, cls, given):
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    dests = {a.dest: a for a in sub._actions}
    def check(klass: type) -> None:
        docs = attribute_docs(klass)
        for f in dataclasses.fields(klass):
            if f.name in given or f.metadata.get(NO_FLAG):
                continue
            if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
                check(f.default_factory)  # a group: its fields are the flags
                continue
            assert f.name in dests, f"{klass.__name__}.{f.name} has no flag"
            assert dests[f.name].help.startswith(docs[f.name].replace("%", "%%")), f.name

    check(cls)


def test_flag_names_types_and_none():
    args = build_parser(only="router").parse_args(
        ["router", "--kv-service", "none", "--workers", "a:1, b:2", "--request-timeout", "7.5", "--model", "/m",
         "--seed", "3"])
    cfg = config_from_args(RouterConfig, args)
    assert (cfg.kv_service, cfg.workers, cfg.routing.request_timeout_s, cfg.model_dirs,
            cfg.routing.policy_config.seed) == (None, ["a:1", "b:2"], 7.5, ["/m"], 3)
    engine = config_from_args(EngineConfig, build_parser(only="worker").parse_args(
        ["worker", "--no-prefix-caching", "--num-blocks", "64"]), model="m")
    assert (engine.enable_prefix_caching, engine.num_blocks) == (False, 64)
    with pytest.raises(SystemExit):
        build_parser(only="worker").parse_args(["worker", "--num-blocks", "many"])


def test_a_renamed_flag_keeps_its_old_name_for_a_release_and_says_so(capsys):
    """--claim-attempts became --reservation-attempts (issue 41): both set the field, the old one warns,
    and --help names it deprecated; `kvmesh simulate` takes the routing flags under the same names."""
    for command, extra in (("router", []), ("simulate", ["--workload", "hot-prompt"])):
        parser = build_parser(only=command)
        new = parser.parse_args([command, *extra, "--reservation-attempts", "4"])
        assert new.reservation_attempts == 4 and capsys.readouterr().err == ""
        old = parser.parse_args([command, *extra, "--claim-attempts", "3"])
        assert old.reservation_attempts == 3
        assert "--claim-attempts is deprecated" in capsys.readouterr().err
    assert config_from_args(RouterConfig, build_parser(only="router").parse_args(
        ["router", "--claim-attempts", "2"])).routing.reservation_attempts == 2
    sub = next(a for a in build_parser(only="router")._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["router"]._actions if a.dest == "reservation_attempts")
    assert action.option_strings == ["--reservation-attempts", "--claim-attempts"]
    assert "--claim-attempts: the old name, deprecated" in action.help


def test_a_field_without_a_docstring_is_refused():
    @dataclasses.dataclass
    class Undocumented:
        documented: int = 1
        """Has help."""
        bare: str = flag("x", name="bare-flag")

    with pytest.raises(TypeError, match="Undocumented.bare has no docstring"):
        add_config_args(argparse.ArgumentParser(), Undocumented)


def test_an_optional_bool_takes_a_flag_and_its_no_flag_and_leaves_none_to_the_code():
    def engine(*argv: str) -> EngineConfig:
        return config_from_args(EngineConfig, build_parser(only="worker").parse_args(["worker", *argv]), model="m")

    assert engine().compile is None
    assert engine("--compile").compile is True
    assert engine("--no-compile").compile is False
    assert (engine().enforce_eager, engine("--enforce-eager").enforce_eager) == (False, True)
    assert engine("--cuda-graph-sizes", "1,2,8").cuda_graph_sizes == [1, 2, 8]


def test_the_compile_default_is_per_device_and_graph_sizes_are_checked():
    from kvmesh.model_worker.config import ModelConfig

    model = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8,
                                   "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "intermediate_size": 8})
    for device, want in (("cpu", False), ("cuda", True), ("cuda:1", True)):
        cfg = EngineConfig(model="m", device=device)
        cfg.check(model)
        assert cfg.compile is want, device
    explicit = EngineConfig(model="m", device="cpu", compile=True)
    explicit.check(model)
    assert explicit.compile is True
    with pytest.raises(ValueError, match=r"cuda_graph_sizes must lie in \[1, max_num_seqs = 8\].*\[0, 16\]"):
        EngineConfig(model="m", max_num_seqs=8, cuda_graph_sizes=[0, 4, 16]).check(model)
