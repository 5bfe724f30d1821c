"""What the tests, ``hscapture demo`` and ``hscapture verify --model`` check captures against: tiny
models built from ``transformers`` configs (``tiny``), the HF transformers reference (``reference``),
and the token-by-token comparison (``compare``)."""
