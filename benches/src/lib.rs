//! Criterion benchmarks of the workspace live in `benches/benches/`; this library is empty.
