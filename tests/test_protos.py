"""The committed stubs in kvmesh/v1/ are exactly what `make protos` generates."""

from __future__ import annotations

import filecmp

from kvmesh import protogen


def test_regenerating_stubs_gives_no_diff(tmp_path):
    protogen.generate(tmp_path)
    generated = sorted(p.name for p in (tmp_path / "kvmesh" / "v1").iterdir())
    committed_dir = protogen.ROOT / "kvmesh" / "v1"
    committed = sorted(p.name for p in committed_dir.iterdir() if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert generated == committed
    stale = [n for n in generated if not filecmp.cmp(tmp_path / "kvmesh" / "v1" / n, committed_dir / n, shallow=False)]
    assert stale == [], f"stubs out of date, run `make protos`: {stale}"


def test_enums_follow_buf_style():
    from kvmesh.v1 import common_pb2, kv_service_pb2

    for module in (common_pb2, kv_service_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), zero
    assert common_pb2.DESCRIPTOR.package == "kvmesh.v1"
