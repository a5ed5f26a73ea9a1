from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "registry"
    # The app label from before the registry had a package of its own (it was ``scoring``): the
    # tables (scoring_pod, ...), the migration history, the permissions and the admin's URLs
    # (/admin/scoring/pod/) of every existing database stay as they are.
    label = "scoring"
