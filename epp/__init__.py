"""The Endpoint Picker (EPP) of the Gateway API Inference Extension: names the pod for each request."""
