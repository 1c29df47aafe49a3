"""``vj.functionalize``: a stateful function traced, its passes run, and its ``init`` and
``apply`` returned as pure functions of the variables (``functionalized.py``)."""
