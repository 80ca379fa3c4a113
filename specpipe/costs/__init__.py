"""What a pipeline step costs on a device: cost profiles and links (profile.py), profiles derived
from published specifications (roofline.py, shipped under profiles/), and their measurement on
this device (measure.py). The planner (`--layers-per-step auto`), `specpipe profile` and the
simulator all read the same profiles, so this room sits below the engine and imports nothing
above it."""
