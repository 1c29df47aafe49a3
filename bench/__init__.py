"""varjax benchmarks (not tests): ``python -m bench`` or ``make bench``; see ``__main__``."""
