"""Helpers for NPU-free tests and CI: tiny offline models, a CPU harness for real vLLM code."""
