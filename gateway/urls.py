from django.urls import path

from . import batch_views, openapi, views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/embeddings", views.embeddings, name="embeddings"),
    path("v1/responses", views.responses, name="responses"),
    path("v1/responses/<str:response_id>", views.response_detail, name="response-detail"),
    path("v1/responses/<str:response_id>/input_items", views.response_input_items, name="response-input-items"),
    path("v1/files", batch_views.files, name="files"),
    path("v1/files/<str:file_id>", batch_views.file_detail, name="file-detail"),
    path("v1/files/<str:file_id>/content", batch_views.file_content, name="file-content"),
    path("v1/batches", batch_views.batches, name="batches"),
    path("v1/batches/<str:batch_id>", batch_views.batch_detail, name="batch-detail"),
    path("v1/batches/<str:batch_id>/cancel", batch_views.batch_cancel, name="batch-cancel"),
    path("v1/models", views.models, name="models"),
    path("v1/models/<str:name>", views.model_detail, name="model-detail"),
    path("v1/openapi.json", openapi.schema, name="openapi"),
]
