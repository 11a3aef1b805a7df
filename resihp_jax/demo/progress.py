"""Progress of a demo run: a tqdm bar with the plan and tokens/s on a terminal, plain lines
every few steps in a log file or pipe (a bar's carriage returns make logs unreadable), or
nothing. Event lines (verdicts, re-plans) always reach `out`, without tearing the bar."""

from __future__ import annotations

from typing import TextIO

MODES = ("bar", "lines", "off")


def progress_mode(no_progress: bool, stream: TextIO) -> str:
    if no_progress:
        return "off"
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


class Progress:
    def __init__(self, total: int, mode: str, out: TextIO, err: TextIO,
                 every: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: valid are {MODES}")
        self.total, self.mode, self.out, self.err = total, mode, out, err
        self.every = every or max(1, min(8, total // 8))
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", file=err, dynamic_ncols=True)

    def step(self, step: int, plan: str, tokens_per_s: float, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s  loss {loss:.3f}  {plan}",
                                      refresh=False)
            self._bar.update(step - self._bar.n)  # a restore from a checkpoint goes back
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total}  {tokens_per_s:,.0f} tokens/s  loss {loss:.3f}  "
                  f"plan {plan}", file=self.err, flush=True)

    def event(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
