"""The examples are scripts to run or copy, each standing alone; this file only lets the tests
import their models (tests/zoo.py reuses the Llama-style decoder and the CNN)."""
