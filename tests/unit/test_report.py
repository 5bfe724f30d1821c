"""Progress (bar on a terminal, log lines otherwise) and the end report."""

import io
import time

from hscapture.cli.engine import index_of
from hscapture.cli.report import ExtractReport, Progress


def test_log_lines_every_n_seconds_with_rate_bytes_and_eta():
    s = io.StringIO()
    p = Progress(10, 1000, bytes_per_token=1_000_000, interactive=False, every=0.05, stream=s)
    p.update(1, 100)
    assert s.getvalue() == "", "not before N seconds"
    time.sleep(0.06)
    p.update(4, 400)
    line = s.getvalue().strip()
    assert line.startswith("[hscapture] 5/10 samples (50.0%), 500 tokens, ") and "tokens/s, 0.500 GB" in line
    rate = float(line.split(" tokens/s")[0].rsplit(" ", 1)[-1].replace(",", ""))
    assert 400 / 5 < rate < 400 / 0.06 * 1.01, "the rate counts from the first finished request (no warm-up)"
    assert "ETA 0:00:0" in line
    p.close()
    assert s.getvalue().strip().splitlines()[-1].startswith("[hscapture] 5/10 samples")


def test_bar_shows_samples_rate_gigabytes_and_eta():
    s = io.StringIO()
    p = Progress(4, 40, bytes_per_token=2**20, interactive=True, stream=s)
    for _ in range(4):
        p.update(1, 10)
    p.close()
    out = s.getvalue()
    assert "4/4 samples" in out and "tok/s" in out and "GB" in out and "100%" in out


def test_report_names_checks_shard_format_and_place():
    r = ExtractReport(
        out="/o",
        samples=3,
        tokens=30,
        bytes=3 * 2**20,
        seconds=2.0,
        layer_ids=[1, 4],
        convention="before",
        dtype="bfloat16",
        shims=[],
        resumed=2,
        format="legacy",
        shard="1/4",
        checks=["a", "b"],
    )
    text = "\n".join(r.lines())
    assert "samples     3 (+2 finished earlier, kept)" in text and "throughput  15 tokens/s (2.0 s capture)" in text
    r.steady_tokens_per_s = 1234.0
    assert "throughput  15 tokens/s (2.0 s capture; 1,234 tokens/s after the first forward)" in "\n".join(r.lines())
    assert "shard       1/4" in text and "checks      a\nchecks      b" in text
    assert "output      /o/data_{i}.pt + sample_lengths.json + data_config.json + manifest.json" in text


def test_request_ids_map_back_to_rows():
    assert index_of("hs-12") == 12 and index_of("hs-12-9f3a2b1c") == 12 and index_of("other") is None


def test_report_says_when_files_are_compressed_and_samples_were_skipped():
    base = dict(
        out="/o",
        samples=6,
        tokens=60,
        bytes=600,
        seconds=1.0,
        layer_ids=[1],
        convention="after",
        dtype="float32",
        shims=[],
    )
    plain = "\n".join(ExtractReport(**base).lines())
    assert "skipped" not in plain and "compressed" not in plain
    text = "\n".join(ExtractReport(**base, skipped=2, compressed=True).lines())
    assert "2 skipped for NaN/Inf values (listed in the manifest, retried by --resume)" in text
    assert "hidden_states.zst" in text and "safetensors.load_file alone sees only the compressed bytes" in text


def test_verify_tolerance_follows_the_dtypes_compared():
    from hscapture.cli.verify import tolerance

    assert tolerance({"dtype": "float32"}) == 1e-3
    assert tolerance({"dtype": "float32", "model_dtype": "bfloat16"}) == 3e-2, "a float32 checkpoint run in bf16"
    assert tolerance({"dtype": "bfloat16", "model_dtype": "float32"}) == 3e-2
    assert tolerance({"dtype": "float16", "model_dtype": "float16"}) == 1e-2
