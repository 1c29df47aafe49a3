"""Tracing: the variable API model code calls (``vj.param``, ``vj.Variable``, ...), the trace
context that answers it, RNG streams, and the checks a given variable meets."""
