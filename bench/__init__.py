"""The benchmarks: each module that is a script runs from the repository root as
``python -m bench.NAME`` (``bench/README.md``); the modules with a leading underscore are
their shared parts (the emulated network, the runs, the scenarios, the tables). Every
figure is a ratio to a baseline measured in the same invocation. The package under test is
imported through its public names only."""
