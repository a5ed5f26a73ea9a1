from django.apps import AppConfig


class SimulatorConfig(AppConfig):
    name = "simulator"
