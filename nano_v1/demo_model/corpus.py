"""The demo model's corpus: the Python standard library's own sources, split by file.

No vLLM counterpart (vLLM serves checkpoints trained elsewhere); used by the demo model (chapter 01).

Why it exists: the bundled model must be reproducible offline, so its training text is
something every Python installation already has. The file list is sorted, the held-out split
is a hash of each file's relative path (stable when files are added or removed), and the
baseline every trained model must beat, the unigram cross-entropy, lives here beside the data
it is measured on.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

# Directories under the stdlib that are not "the standard library's code": installed
# third-party packages, the regression tests, C extensions, build configuration, and
# generated tables (codec maps, pydoc's topic dump).
EXCLUDED_TOP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "lib-dynload", "encodings", "pydoc_data"}
)
# Test suites nested inside packages (ctypes/test, lib2to3/tests, idlelib/idle_test, ...).
EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "__pycache__"})
# Larger files are generated data or single modules big enough to dominate the corpus.
MAX_FILE_BYTES = 200_000
# One file in HELDOUT_EVERY (by path hash) is kept out of training for validation.
HELDOUT_EVERY = 20


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files under `root` (default: the stdlib), sorted."""
    root = stdlib_dir() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a directory")
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        at_top = here == root
        # Prune in place so os.walk never descends into excluded trees (site-packages is large).
        dirnames[:] = [
            d
            for d in dirnames
            if d not in EXCLUDED_DIR_NAMES
            and not (at_top and (d in EXCLUDED_TOP_DIRS or d.startswith("config-")))
        ]
        relpaths += [
            (here / name).relative_to(root).as_posix()
            for name in filenames
            if name.endswith(".py")
            and not name.startswith("_sysconfigdata")
            and (here / name).stat().st_size <= MAX_FILE_BYTES
        ]
    return sorted(relpaths)


def is_heldout(relpath: str) -> bool:
    """Whether a file belongs to the validation split (a fixed function of its path alone)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_EVERY == 0


def split_files(relpaths: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths, each in the input's order."""
    train = [p for p in relpaths if not is_heldout(p)]
    heldout = [p for p in relpaths if is_heldout(p)]
    return train, heldout


def read_sources(relpaths: list[str], root: Path | None = None) -> list[str]:
    """The text of each file; files that are not valid UTF-8 are skipped."""
    root = stdlib_dir() if root is None else Path(root)
    texts = []
    for relpath in relpaths:
        try:
            texts.append((root / relpath).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def unigram_cross_entropy(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of `heldout_ids` under unigram frequencies of `train_ids`.

    This is the best a model can do that ignores context entirely. Add-one smoothing gives
    tokens unseen in training a finite cost.
    """
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())  # [vocab_size]
    return float(-log_probs[heldout_ids].mean())
