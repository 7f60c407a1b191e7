"""A progress bar: tqdm when it is installed, else one plain line on stderr every few seconds."""

from __future__ import annotations

import sys
import time
from typing import Any

PLAIN_EVERY_S = 5.0


class Progress:
    def __init__(self, total: int, description: str, unit: str = "it", initial: int = 0, enabled: bool = True) -> None:
        self.total, self.description, self.unit, self.count = total, description, unit, initial
        self.enabled, self.started, self.shown = enabled, time.monotonic(), 0.0
        self.postfix: dict[str, Any] = {}
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True)

    def update(self, count: int = 1, **postfix: Any) -> None:
        self.count += count
        self.postfix.update(postfix)
        if self.bar is not None:
            self.bar.update(count)
            if postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
        elif self.enabled and (time.monotonic() - self.shown >= PLAIN_EVERY_S or self.count >= self.total):
            self.shown = time.monotonic()
            rate = self.count / max(self.shown - self.started, 1e-9)
            details = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.postfix.items())
            print(
                f"{self.description}: {self.count}/{self.total} {self.unit} ({rate:.1f}/s) {details}", file=sys.stderr
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
