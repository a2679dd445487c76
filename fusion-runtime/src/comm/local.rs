//! In-process communicator for simulated devices (being written).
