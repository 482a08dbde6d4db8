import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
