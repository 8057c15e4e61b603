"""Every HSDP group (and every Paddle HCG group) of a layout exists, has the right
members and works: common.init_fleet checks them (as it does in every launch)."""

from common import config_from_argv, finish, init_fleet

init_fleet(config_from_argv())
finish()
