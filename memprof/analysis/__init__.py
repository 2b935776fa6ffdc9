"""Pure analysis of captures: numpy and dataclasses in, frozen dataclasses and tables out; nothing
here prints, reads files or imports torch. Each concept has one home:

- `units`: byte formatting and the CUDA caching allocator's block rounding;
- `scopes`: scope begin/end pairing (stacks, slices, outermost calls, top-level children);
- `timeline`: per-device live bytes, peaks, step windows and steps, the garbage collector's frees;
- `wrapper_code`: the parser of Inductor's wrapper code (one lexer for the join and the estimate);
- `join`, `labels`, `attribution`: what every allocation is, and what is live at a point;
- `summary`: the typed summary the reporters format.
"""
