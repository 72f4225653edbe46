"""Reading load from vLLM's /metrics page: the few samples kvroute needs, read by name,
agree with a full Prometheus text-format parse (prometheus_client's own parser)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvroute.app.routing.load import Load, parse_load
from tests.support.paths import FIXTURES

PAGE = FIXTURES / "vllm-0.32.0-metrics.txt"
FIELDS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_usage", "vllm:prompt_tokens_total": "work",
          "vllm:generation_tokens_total": "work",
          "vllm:time_to_first_token_seconds_sum": "ttft_sum",
          "vllm:time_to_first_token_seconds_count": "ttft_count",
          "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
          "vllm:e2e_request_latency_seconds_count": "e2e_count"}


def reference(text: str) -> dict[int, Load]:
    """The same readings through a complete parser of the format."""
    values: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = FIELDS.get(sample.name)
            if field is None:
                continue
            engine = sample.labels.get("engine", "0")
            rank = int(engine) if engine.isdigit() else 0
            per_rank = values.setdefault(rank, {})
            per_rank[field] = per_rank.get(field, 0.0) + sample.value
    return {rank: Load(read_at=0.0, **fields) for rank, fields in values.items()}


def test_a_real_vllm_page_reads_like_the_full_parse():
    text = PAGE.read_text()
    loads = parse_load(text, read_at=0.0)
    assert loads == reference(text)
    # 20 requests of 300 prompt tokens and 8 generated tokens each, then idle
    assert loads == {0: Load(running=0.0, waiting=0.0, kv_usage=0.0, work=6000.0 + 160.0,
                             ttft_sum=0.21129584312438965, ttft_count=20.0,
                             e2e_sum=0.6576478481292725, e2e_count=20.0)}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


model_names = st.text(alphabet='ab,={}" \\\n/engine09', max_size=16)
names = st.sampled_from([*FIELDS, "vllm:num_requests_waiting_by_reason",
                         "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_created",
                         "vllm:generation_tokens_created",
                         "vllm:e2e_request_latency_seconds_bucket"])
samples = st.lists(st.tuples(names, st.integers(0, 3), model_names,
                             st.floats(0, 1e6, allow_nan=False), st.booleans(),
                             st.booleans()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(samples)
@example([("vllm:num_requests_running", 1, 'a,engine="9",b{}', 2.0, False, True)])
def test_any_page_reads_like_the_full_parse(lines):
    """Model names with quotes, commas, braces, newlines and the text engine="9" inside;
    labels in either order; timestamps; look-alike families."""
    families: dict[str, list[str]] = {}
    for name, engine, model, value, engine_first, stamped in lines:
        labels = [f'engine="{engine}"', f'model_name="{_escape(model)}"']
        if not engine_first:
            labels.reverse()
        line = f"{name}{{{','.join(labels)}}} {value!r}" + (" 1700000000000" if stamped else "")
        families.setdefault(name, []).append(line)
    text = "".join(
        f"# HELP {name} x\n# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}\n"
        + "".join(f"{line}\n" for line in body) for name, body in families.items())
    assert parse_load(text, read_at=0.0) == reference(text)


def test_long_lines_are_skipped_and_any_line_ending_is_read():
    sample = 'vllm:num_requests_running{engine="1",model_name="m"} 3.0'
    assert parse_load(sample, 0.0) == {1: Load(running=3.0)}  # first line, no newline at end
    assert parse_load(f"# x\r\n{sample}\r\n", 0.0) == {1: Load(running=3.0)}
    long_name = sample.replace('"m"', '"' + "m" * 20_000 + '"')
    assert parse_load(f"{long_name}\n", 0.0) == {}


def test_hostile_pages_read_as_nothing():
    """Shapes that made a regex backtrack through a whole line, or splitlines() hold a
    string per line (the scraper caps a page at 4 MiB; these are smaller, same shapes)."""
    for page in ("vllm:num_requests_running{" + "a" * 200_000,
                 'vllm:num_requests_running{x="' + '\\"' * 100_000,
                 ("vllm:num_requests_running{" + 'a="b",' * 2000 + "\n") * 20,
                 "\n" * 1_000_000, "vllm:\n" * 100_000):
        assert parse_load(page, 0.0) == {}
