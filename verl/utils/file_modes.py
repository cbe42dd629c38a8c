"""File modes of exported weights: transformers' ``save_pretrained`` writes ``*.safetensors`` through a private
temporary file (mode 0600) while the files beside it follow the umask (0644 under the usual 022); an export gives
its weight files the same mode as the rest."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["umask_file_mode", "weights_like_the_rest"]


def umask_file_mode() -> int:
    """The mode a new file gets from ``open()`` under this process's umask (0o666 & ~umask)."""
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def weights_like_the_rest(directory: str | Path) -> None:
    """Give every ``*.safetensors`` file of ``directory`` the umask's mode, as its other files have."""
    mode = umask_file_mode()
    for path in Path(directory).glob("*.safetensors"):
        os.chmod(path, mode)
