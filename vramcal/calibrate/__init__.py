"""calibrate"""
