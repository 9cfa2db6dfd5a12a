"""Where kvcompress keeps per-machine caches (converted weights, kv_stats)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$KVCOMPRESS_CACHE, else ~/.cache/kvcompress (the same rule as conf/config.yaml)."""
    return Path(os.environ.get("KVCOMPRESS_CACHE") or Path.home() / ".cache" / "kvcompress")
