"""Public serving traces: Mooncake's and Azure's formats, read into one request type (chapter 11).

* Mooncake (FAST'25; JSON lines): ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids``, one id per 512-token prompt block. The ids are chained: two requests share their
  first ``k`` ids exactly when they share their first ``k * 512`` prompt tokens. That is all a
  block-level replay needs -- one trace id is one KV block.
* Azure (Splitwise, ISCA 2024; CSV): ``TIMESTAMP,ContextTokens,GeneratedTokens``. Arrival times
  and lengths only: nothing says which requests share a prefix.

The files ship in ``data/`` (``data/README.md`` has their licenses): Mooncake's synthetic trace
and its production conversation trace, and Azure's code trace. The other traces the two
projects publish in the same formats load unchanged. A line that does not parse raises
``TraceFormatError`` naming the file and the line.

From a shell::

    python -m course_pkg.workloads.replay describe data/mooncake_synthetic_trace.jsonl
    python -m course_pkg.workloads.replay replay data/mooncake_synthetic_trace.jsonl --policy radix --pool 4000
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from course_pkg.validation import INT64_MAX

MOONCAKE_BLOCK_SIZE = 512   # tokens per hash id in Mooncake's traces
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
MOONCAKE_TRACE = DATA_DIR / "mooncake_synthetic_trace.jsonl"                  # synthetic, from public datasets
MOONCAKE_CONVERSATION_TRACE = DATA_DIR / "mooncake_conversation_trace.jsonl"   # one hour of production traffic
AZURE_CODE_TRACE = DATA_DIR / "azure_llm_inference_code_2023.csv"


class TraceFormatError(ValueError):
    """A trace line that does not parse; the message names the file and the line."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``hash_ids``: Mooncake's block ids (None for Azure, which has none)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None

    @property
    def num_blocks(self) -> int:
        """Prompt blocks of ``MOONCAKE_BLOCK_SIZE`` tokens: ceil(input_length / 512)."""
        return -(-self.input_length // MOONCAKE_BLOCK_SIZE)


def _count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64_MAX:
        raise ValueError(f"{what} must be an integer in [0, 2**63), got {value!r}")
    return value


def _text_lines(path, f):
    """The lines of the binary file ``f`` as text, naming the line that is not UTF-8."""
    for lineno, raw in enumerate(f, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(f"{path}, line {lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                   f"column {e.start + 1})") from None


def _limit(limit) -> int | None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")
    return limit


def load_mooncake(path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake trace (JSON lines), in file order; the first ``limit`` only if given.

    Checked per line: the four fields, counts >= 0, ``len(hash_ids) == ceil(input_length / 512)``,
    and across lines that an id always follows the same parent id (the chained-prefix property
    the replay relies on).
    """
    limit = _limit(limit)
    requests: list[TraceRequest] = []
    parent_of: dict[int, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(_text_lines(path, f), 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("a line must be a JSON object")
                missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
                if missing:
                    raise ValueError(f"missing field(s) {missing}")
                ts = row["timestamp"]
                if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
                    raise ValueError(f"timestamp must be a number >= 0, got {ts!r}")
                input_length = _count(row["input_length"], "input_length")
                output_length = _count(row["output_length"], "output_length")
                ids = row["hash_ids"]
                if not isinstance(ids, list):
                    raise ValueError(f"hash_ids must be a list, got {type(ids).__name__}")
                ids = tuple(_count(x, "every hash id") for x in ids)
                expected = -(-input_length // MOONCAKE_BLOCK_SIZE)
                if len(ids) != expected:
                    raise ValueError(f"{len(ids)} hash_ids for input_length {input_length}: "
                                     f"expected ceil({input_length} / {MOONCAKE_BLOCK_SIZE}) = {expected}")
                parent = -1
                for x in ids:
                    if parent_of.setdefault(x, parent) != parent:
                        raise ValueError(f"hash id {x} follows {parent} here but {parent_of[x]} "
                                         "on an earlier line: the ids are not chained prefixes")
                    parent = x
            except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                raise TraceFormatError(f"{path}, line {lineno}: {e}") from None
            requests.append(TraceRequest(float(ts), input_length, output_length, ids))
    return requests


AZURE_COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def _parse_azure_time(text: str) -> datetime:
    # "2023-11-16 18:17:03.9799600": seven fraction digits, one more than datetime reads.
    whole, _, fraction = text.strip().partition(".")
    return datetime.strptime(f"{whole}.{(fraction or '0')[:6]:0<6}", "%Y-%m-%d %H:%M:%S.%f")


def load_azure(path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of an Azure LLM inference trace (CSV), in file order; ``timestamp_ms`` counts
    from the first request. ``hash_ids`` is None: the format says nothing about shared prefixes."""
    limit = _limit(limit)
    requests: list[TraceRequest] = []
    start = None
    with open(path, "rb") as f:
        reader = csv.reader(_text_lines(path, f))
        header = next(reader, None)
        if header != AZURE_COLUMNS:
            raise TraceFormatError(f"{path}, line 1: expected the header {','.join(AZURE_COLUMNS)}, got {header}")
        for row in reader:
            if limit is not None and len(requests) >= limit:
                break
            lineno = reader.line_num
            if not any(field.strip() for field in row):   # a blank line (the files end with one)
                continue
            try:
                if len(row) != 3:
                    raise ValueError(f"expected 3 fields, got {len(row)}")
                when = _parse_azure_time(row[0])
                input_length = _count(int(row[1]), "ContextTokens")
                output_length = _count(int(row[2]), "GeneratedTokens")
            except ValueError as e:
                raise TraceFormatError(f"{path}, line {lineno}: {e}") from None
            start = when if start is None else start
            ms = (when - start).total_seconds() * 1000
            if ms < 0:
                raise TraceFormatError(f"{path}, line {lineno}: timestamp {row[0]} is before the first request's")
            requests.append(TraceRequest(ms, input_length, output_length, None))
    return requests


def load_trace(path, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake for ``.jsonl``, Azure for ``.csv``."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return load_mooncake(path, limit)
    if suffix == ".csv":
        return load_azure(path, limit)
    raise ValueError(f"{path}: unknown trace format {suffix!r} (Mooncake .jsonl or Azure .csv)")


@dataclass(frozen=True)
class TraceSummary:
    num_requests: int
    duration_s: float
    mean_input: float
    median_input: int
    max_input: int
    mean_output: float
    num_blocks: int             # prompt blocks over all requests (0 without hash ids)
    num_distinct_blocks: int    # distinct hash ids (0 without hash ids)
    max_request_blocks: int

    def __str__(self) -> str:
        lines = [f"requests            {self.num_requests:,}",
                 f"duration            {self.duration_s:,.1f} s",
                 f"input tokens        mean {self.mean_input:,.0f}, median {self.median_input:,}, max {self.max_input:,}",
                 f"output tokens       mean {self.mean_output:,.0f}"]
        if self.num_blocks:
            lines += [f"prompt blocks       {self.num_blocks:,} ({self.num_distinct_blocks:,} distinct: "
                      f"{1 - self.num_distinct_blocks / self.num_blocks:.1%} are repeats)",
                      f"largest request     {self.max_request_blocks} blocks"]
        return "\n".join(lines)


def summarize(trace: list[TraceRequest]) -> TraceSummary:
    if not trace:
        raise ValueError("the trace is empty")
    inputs = sorted(r.input_length for r in trace)
    with_ids = [r for r in trace if r.hash_ids is not None]
    return TraceSummary(
        num_requests=len(trace),
        duration_s=(trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000,
        mean_input=sum(inputs) / len(inputs), median_input=inputs[len(inputs) // 2], max_input=inputs[-1],
        mean_output=sum(r.output_length for r in trace) / len(trace),
        num_blocks=sum(len(r.hash_ids) for r in with_ids),
        num_distinct_blocks=len({x for r in with_ids for x in r.hash_ids}),
        max_request_blocks=max((len(r.hash_ids) for r in with_ids), default=0))
