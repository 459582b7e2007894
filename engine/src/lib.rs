//! ultrafast-engine: in-process inference (see the engine issue).
