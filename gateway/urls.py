from django.urls import path

from . import openapi, views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/responses", views.responses, name="responses"),
    path("v1/responses/<str:response_id>", views.response_detail, name="response-detail"),
    path("v1/responses/<str:response_id>/input_items", views.response_input_items, name="response-input-items"),
    path("v1/models", views.models, name="models"),
    path("v1/models/<str:name>", views.model_detail, name="model-detail"),
    path("v1/openapi.json", openapi.schema, name="openapi"),
]
