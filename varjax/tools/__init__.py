"""Tools beside the stack: dumping, printing, summarizing and graphing the IR."""
