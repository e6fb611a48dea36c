"""Regenerate the committed stubs in protos/episerve_proto, or check that they are current.

    python protos/generate.py           # write the stubs
    python protos/generate.py --check   # exit 1 if the committed stubs differ
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
SOURCES = sorted((HERE / "episerve" / "v1").glob("*.proto"))
# No service stubs: both sides call the methods by path (episerve_proto.contract) and the
# daemon parses requests itself, so only the messages are generated.
GENERATED = ("episerve_pb2.py", "episerve_pb2.pyi")


def generate(out: Path) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{include}",
        # Map the source folder so generated imports read `episerve_proto.v1...`.
        f"-Iepiserve_proto={HERE / 'episerve'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        *[f"episerve_proto/v1/{p.name}" for p in SOURCES],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    target = HERE / "episerve_proto" / "v1"
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "episerve_proto" / "v1"
        if "--check" in sys.argv:
            stale = [n for n in GENERATED if not (target / n).exists()
                     or not filecmp.cmp(fresh / n, target / n, shallow=False)]
            if stale:
                print(f"stubs are out of date: {stale}; run python protos/generate.py")
                return 1
            print("stubs are up to date")
            return 0
        for name in GENERATED:
            shutil.copyfile(fresh / name, target / name)
    print(f"wrote {', '.join(GENERATED)} to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
