"""The nine stages of stagewise. Each sub-package is a complete engine; see docs/index.md."""
