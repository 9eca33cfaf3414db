"""The transforms, one per module; the module name is the transform name and its knobs' prefix."""
