from django.apps import AppConfig


class EppConfig(AppConfig):
    name = "epp"
    verbose_name = "Endpoint Picker"
