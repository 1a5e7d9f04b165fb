"""How ranks are arranged and talk: the one layout object, process groups, the DeepSpeed JSON, every private
DeepSpeed/torch touch point, the collectives counter."""
