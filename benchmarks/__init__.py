"""lockgate benchmark suites: `python -m benchmarks.run` (see benchmarks/README.md)."""
