"""The parts of ``benchmarks/bench_core.py``, one module per section of its report.

``bench_core.py`` is the command (``python benchmarks/bench_core.py [flags]``); these modules
measure (:mod:`.save`, :mod:`.restore`, :mod:`.cold`, :mod:`.stall`, :mod:`.codecs`), judge
(:mod:`.rows`) and write (:mod:`.report`). They import ``_common`` from ``benchmarks/``, which
``bench_core.py`` puts on ``sys.path``.
"""
