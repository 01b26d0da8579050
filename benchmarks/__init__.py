"""cadence's benchmarks, by subject as ``src/`` is: ``checkpoint/`` (save, load, stall, sharded, resume),
``loop/`` (the loop's overheads, compile, the GPU loop), ``faults/`` (goodput, S3 under kill -9),
``sidecar/``; ``common/`` holds the results writer and the examples' tasks, ``run.py`` (``make bench``)
and ``docs_tables.py`` (the docs' measured tables) sit here.

One package, imported as ``benchmarks.<group>.<module>`` from the checkout's root: ``python -m
benchmarks.run``, or a file run as a script (``python benchmarks/loop/overhead.py --quick``), which puts
the root, instead of its own folder, first on ``sys.path``. No module's name stands alone on the path, so
none shadows another (``benchmarks/checkpoint/`` is never ``checkpoint``).
"""
