"""docs/KEYMAP.md is right: its keymaps parse or fail as shown, its worked examples are what
the daemon's window code and the per-entry oracle compute, and its Python runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from episerve_client.messages import keymap_message
from episerve_proto.errors import KeymapError
from episerve_server.core.keymap import Keymap
from episerve_server.core.windows import window
from episerve_server.rpc.wire.messages import Limits, keymap_from_pb
from tests.support import oracle

DOC = (Path(__file__).resolve().parents[2] / "docs" / "KEYMAP.md").read_text()
YAML = re.findall(r"```yaml\n(.*?)```", DOC, flags=re.S)
PYTHON = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
ROWS = re.findall(r"^\| `(\{.*?\})` \| (\d+) \| (\d+) \| (\d+) \| ([\d ]+) \| ([TF -]+) \|$",
                  DOC, flags=re.M)


def test_the_document_has_its_examples() -> None:
    assert len(YAML) >= 10 and len(PYTHON) >= 1 and len(ROWS) >= 20
    assert sum(block.startswith("# refused:") for block in YAML) >= 9


@pytest.mark.parametrize("block", YAML, ids=lambda b: b.splitlines()[0][:60])
def test_yaml_blocks_parse_or_fail_as_shown(block: str) -> None:
    raw = yaml.safe_load(block)
    first = block.splitlines()[0]
    if not first.startswith("# refused:"):
        Keymap.parse(raw)
        return
    needle = first.removeprefix("# refused:").strip()
    with pytest.raises(KeymapError) as local:
        Keymap.parse(raw)
    assert needle in str(local.value)
    # the same message through the client and the wire, whichever side refuses it
    with pytest.raises(KeymapError) as sent:
        keymap_from_pb(keymap_message(raw), Limits(64, 256, 64 << 10))
    assert needle in str(sent.value)


@pytest.mark.parametrize(("entry", "i", "total", "fps", "rows", "pads"), ROWS)
def test_worked_examples(entry: str, i: str, total: str, fps: str, rows: str,
                         pads: str) -> None:
    fields: dict[str, Any] = {"zarr_key": "k", **yaml.safe_load(entry)}
    spec = Keymap.parse({"out": fields}).entries[0]
    w = window(spec, np.array([int(i)]), np.array([int(total)]),
               np.array([float(fps)]), None)
    want_rows = [int(r) for r in rows.split()]
    assert w.rows[0].tolist() == want_rows
    got_rows, mask = oracle.entry_indices(fields, int(i), int(total), int(fps), None)
    assert got_rows == want_rows
    if pads.strip() == "-":
        assert not spec.time_axis and mask is None and w.mask is None
    else:
        want_pad = [p == "T" for p in pads.split()]
        assert spec.time_axis and w.mask is not None and mask is not None
        assert (~w.mask[0]).tolist() == want_pad
        assert [m == 0.0 for m in mask] == want_pad


@pytest.mark.parametrize("code", PYTHON)
def test_python_blocks_run(code: str) -> None:
    exec(compile(code, "docs/KEYMAP.md", "exec"), {})
