"""The pass framework: ``Pass`` and its registry, pipelines, the rewriter, option checks,
instrumentation, verification, dumps and traffic analysis."""
