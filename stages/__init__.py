"""The stages of stagewise, s01 to the newest, one sub-package each: a complete engine, the one
before it plus one idea. `common/stages.py` lists them; see docs/index.md."""
