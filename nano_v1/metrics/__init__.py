"""Engine statistics: what the engine core reports each step, and the frontend's view of it."""
