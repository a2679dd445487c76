//! CPU backend: simulated devices on host memory (being written).
