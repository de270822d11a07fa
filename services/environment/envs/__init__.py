"""Built-in environments: math, code (sandboxed), sliding_puzzle, exact_match, toy_copy, tool_add (a tool call)."""
