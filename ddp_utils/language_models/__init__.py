"""language_models"""
