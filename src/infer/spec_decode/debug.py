"""Round-by-round view of speculative decoding (Leviathan et al., Figure 1).

Accepted drafts in green, the rejected draft (with p and q of that token) in red, drafts after it struck
through as discarded, the recovered or bonus token in blue. Plain text markers when the stream is not a TTY.
"""

from __future__ import annotations

import sys

GREEN, RED, BLUE, DIM, RESET = "\033[32m", "\033[31m", "\033[34m", "\033[2m", "\033[0m"


def format_round(idx: int, record, token_text, color: bool) -> str:
    """One line for a RoundRecord; token_text(id) -> printable string."""
    def paint(code, s):
        return f"{code}{s}{RESET}" if color else s

    parts = []
    n = record.num_accepted
    for i, t in enumerate(record.drafted):
        s = repr(token_text(t))
        if i < n:
            parts.append(paint(GREEN, s) if color else f"+{s}")
        elif i == n:
            pq = f"(p={record.p_rejected:.3f} q={record.q_rejected:.3f})"
            parts.append(paint(RED, s + pq) if color else f"x{s}{pq}")
        else:
            parts.append(paint(DIM, s) if color else f"~{s}")
    if len(record.emitted) > n:  # the final token was not cut off by a stop condition
        final = repr(token_text(record.emitted[n]))
        kind = "bonus" if record.bonus else "recovered"
        parts.append(paint(BLUE, f"{kind} {final}") if color else f"-> {kind} {final}")
    judged = record.expected_accept[: record.tested]  # positions after the first rejection are never judged
    exp = sum(judged) / len(judged) if judged else float("nan")
    if record.nodes:  # a tree round: the accepted path, then the final token (the other nodes are not shown)
        return f"round {idx:3d} tree of {record.nodes} nodes, depth {record.k}: accepted {n}: " + " ".join(parts)
    head = f"round {idx:3d} K={record.k} accepted {n}/{record.k} (E[accept]={exp:.2f}"
    head += f", H_norm={record.h_norm:.2f})" if record.h_norm is not None else ")"
    return f"{head}: " + " ".join(parts)


class RoundPrinter:
    def __init__(self, tokenizer=None, stream=None):
        self.stream = stream or sys.stdout
        self.color = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.tok = tokenizer
        self.count = 0

    def text(self, t: int) -> str:
        return self.tok.token_strings([t])[0] if self.tok is not None else str(t)

    def __call__(self, record, request) -> None:
        self.count += 1
        print(format_round(self.count, record, self.text, self.color), file=self.stream, flush=True)

    def finish(self) -> None:
        """After a generation: say so where no round ran (auto K may price every step at k = 0), rather than leave
        the round-by-round view empty."""
        if self.count == 0:
            print("(no speculative round ran: every token came from a plain decoding step; auto K drafts only where "
                  "its measured costs say a round beats plain decoding)", file=self.stream, flush=True)
